"""The handler API is importable from the product package, without Faust, and ``app.errors`` stays an alias."""

from __future__ import annotations

import subprocess
import sys


def test_handler_api_comes_from_the_product_package_without_faust() -> None:
    code = (
        "import sys\n"
        "from rebound import PermanentError, RetryableError, RetryEvent\n"
        "assert issubclass(RetryableError, Exception) and issubclass(PermanentError, Exception)\n"
        "assert RetryEvent.__name__ == 'RetryEvent'\n"
        "assert 'faust' not in sys.modules, 'importing the handler API pulled Faust in'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_app_errors_is_an_alias_of_the_same_classes() -> None:
    import app.errors
    import rebound

    assert app.errors.RetryableError is rebound.RetryableError
    assert app.errors.PermanentError is rebound.PermanentError
