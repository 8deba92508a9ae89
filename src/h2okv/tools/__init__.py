"""Tools around the runtime (load generator, soak, TP check, tiny random-weight models): the CLI
and the tests import them; the runtime (core, policies, serve) never does."""
