import keyserial


def test_public_names_are_exported_and_sorted() -> None:
    assert keyserial.__all__ == sorted(keyserial.__all__)
    for name in keyserial.__all__:
        assert getattr(keyserial, name) is not None


def test_every_error_descends_from_the_root() -> None:
    errors = [getattr(keyserial, name) for name in keyserial.__all__
              if isinstance(getattr(keyserial, name), type)
              and issubclass(getattr(keyserial, name), Exception)]
    assert len(errors) >= 12
    assert all(issubclass(error, keyserial.KeyserialError) for error in errors)
    assert issubclass(keyserial.SubmitTimeout, TimeoutError)
    assert issubclass(keyserial.BackendUnavailable, ConnectionError)
    assert issubclass(keyserial.InsufficientFunds, keyserial.OperationFailed)
