"""Settings of the wallet example: no database, no sessions; keyserial holds the wallets."""

import os

SECRET_KEY = "example-only-not-secret"
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "wallet_site.urls"
INSTALLED_APPS = ["wallet"]
MIDDLEWARE: list[str] = []
DATABASES: dict[str, dict[str, str]] = {}
USE_TZ = True

#: Where the wallets live: the URL `keyserial dev` serves, unless $KEYSERIAL_REDIS_URL says else.
KEYSERIAL_URL = os.environ.get("KEYSERIAL_REDIS_URL", "redis://127.0.0.1:6390/0")
KEYSERIAL_NAMESPACE = "default"
KEYSERIAL_SHARDS = 16
