"""SQL dialects: how guard rails and analysis read a database protocol's statements (gatewayd.languages).

``postgresql``'s reading is split by what it reads: ``pg_scan`` (deny words,
patterns), ``pg_statements`` (statement rules), ``pg_escapes``
(``standard_conforming_strings = off``); ``mysql``'s likewise: ``mysql_scan``
(the lexer's reading, executable comments, quoting under ``sql_mode``) and
``mysql_statements`` (sqlparser-rs's MySQL grammar).
"""
