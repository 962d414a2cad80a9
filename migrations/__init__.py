"""Alembic migrations of kvguard's SQL schema (gateway tables; canary tables join here).

Run them with ``kvguard admin migrate`` (or automatically at gateway start); the Alembic CLI works
too: ``alembic -c migrations/alembic.ini -x url=<sqlalchemy url> upgrade head``.
"""
