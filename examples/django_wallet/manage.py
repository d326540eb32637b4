"""Django's command-line utility for the wallet example.

Run: pip install django; then python manage.py runserver   (from examples/django_wallet, with a
worker serving wallet.ops: python -m keyserial dev --app wallet.ops)
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "wallet_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
