"""SQL dialects: how guard rails and analysis read a database protocol's statements (gatewayd.languages).

``postgresql`` is the first dialect; its reading is split by what it reads:
``pg_scan`` (deny words, patterns), ``pg_statements`` (statement rules),
``pg_escapes`` (``standard_conforming_strings = off``).
"""
