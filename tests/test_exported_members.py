import keyserial


def test_public_names_are_exported_and_sorted() -> None:
    assert keyserial.__all__ == sorted(keyserial.__all__)
    for name in keyserial.__all__:
        exported = getattr(keyserial, name)
        # Each name is keyserial's own class or function under that name, not a stray import.
        assert (exported.__module__.split(".")[0], exported.__name__) == ("keyserial", name)
    star: dict[str, object] = {}
    exec("from keyserial import *", star)  # what a star import exports
    assert sorted(set(star) - {"__builtins__"}) == keyserial.__all__


def test_every_error_descends_from_the_root() -> None:
    errors = [getattr(keyserial, name) for name in keyserial.__all__
              if isinstance(getattr(keyserial, name), type)
              and issubclass(getattr(keyserial, name), Exception)]
    assert len(errors) >= 12
    assert all(issubclass(error, keyserial.KeyserialError) for error in errors)
    assert issubclass(keyserial.SubmitTimeout, TimeoutError)
    assert issubclass(keyserial.BackendUnavailable, ConnectionError)
    assert issubclass(keyserial.InsufficientFunds, keyserial.OperationFailed)
