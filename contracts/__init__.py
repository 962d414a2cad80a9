"""The contracts between kvguard's deployables: the shapes and rules they share, and the few pure
pieces both sides of a contract run (the SQL unit of work, the SSE splitter, the spool).

Every deployable (``backend``, ``gateway``, ``canary``) imports from here; this package imports
none of them (nor ``kvguard``, the roof that assembles them), so a contract can never pull a
deployable's internals along. ``tests/foundation/test_foundation_layering.py`` holds the
directions.

- ``engine``: the engine's HTTP contract -- capacity report, request headers, the handoff proof a
  response carries;
- ``chat_format``: the bundled engine's chat format and byte tokenizer, the spec a gateway may
  count prompt tokens with itself;
- ``http_edge``: OpenAI-style error bodies, the body guard, the bounded uvicorn protocol;
- ``openai``: validators and readers of OpenAI-shaped bodies both servers apply;
- ``sse``: server-sent events, byte-exact (the engine's streams, the gateway's relay, the canary's
  probe client);
- ``settings``: the settings base class, run mode and secret rules;
- ``plugins``: the gateway's plug-in API (request hooks, response guards, cut/emit, the request
  info and report, hook services);
- ``sql``: the metadata base every SQL table is declared on (the gateway's and the canary's), and
  the unit of work their statements run in;
- ``spool``: the durable local spool both keep records in while their database is unreachable;
- ``capacity``: the largest request a path can take, and the drift statement;
- ``errors``: the base of every error raised on purpose (a stable code and HTTP status);
- ``lifecycle``: the one transition mechanism (``check_move``, ``Machine``,
  ``InvalidTransition``) every lifecycle of every package moves through.
"""
