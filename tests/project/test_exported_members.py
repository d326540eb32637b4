from types import ModuleType

import pytest

import keyserial
import keyserial.testing


def public_names(module: ModuleType) -> set[str]:
    """Every name a user sees on ``module`` (as httpx's test has it): all but underscored names
    and the package's own submodules (``keyserial.errors``), which ``__all__`` does not list.
    (Not the names pytest's assertion rewriting adds, such as ``@py_builtins``, which no code can
    spell: pytest rewrites the modules of a package that registers a plugin, as keyserial does.)"""
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and name.isidentifier()
        and not (isinstance(value, ModuleType) and value.__name__.startswith(f"{module.__name__}."))
    }


@pytest.mark.parametrize("module", [keyserial, keyserial.testing], ids=lambda m: m.__name__)
def test_all_is_exactly_the_public_names_sorted(module: ModuleType) -> None:
    assert module.__all__ == sorted(module.__all__)
    assert set(module.__all__) == public_names(module)
    for name in module.__all__:
        exported = getattr(module, name)
        # Each name is keyserial's own class or function under that name, not a stray import.
        assert (exported.__module__.split(".")[0], exported.__name__) == ("keyserial", name)
    star: dict[str, object] = {}
    exec(f"from {module.__name__} import *", star)  # what a star import exports
    assert sorted(set(star) - {"__builtins__"}) == module.__all__


def test_every_error_descends_from_the_root() -> None:
    errors = [
        getattr(keyserial, name)
        for name in keyserial.__all__
        if isinstance(getattr(keyserial, name), type)
        and issubclass(getattr(keyserial, name), Exception)
    ]
    assert len(errors) >= 12
    assert all(issubclass(error, keyserial.KeyserialError) for error in errors)
    assert issubclass(keyserial.SubmitTimeout, TimeoutError)
    assert issubclass(keyserial.BackendUnavailable, ConnectionError)
    assert issubclass(keyserial.InsufficientFunds, keyserial.OperationFailed)
