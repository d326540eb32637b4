"""Example op modules, served with ``keyserial worker --app workers.shop`` (or ``keyserial dev``).

* :mod:`workers.shop`: a stock counter that never oversells (``restock``, ``reserve``, ``stock``,
  and the multi-key ``reserve_items``);
* :mod:`workers.presence`: the online counter of a chat namespace (``login``, ``logout``,
  ``online``);
* :mod:`workers.mail`: the "order shipped" e-mail, sent once per order (``mark_shipped``,
  ``send_shipped_email``);
* :mod:`workers.mail_pg`: the same e-mail, fenced in PostgreSQL (``send_shipped_email_pg``; needs
  ``asyncpg``).

The built-in ledger ops (``deposit``, ``withdraw``, ``balance``) are always served as well. Op
names are one flat namespace per worker, so the modules here use distinct names.
"""
