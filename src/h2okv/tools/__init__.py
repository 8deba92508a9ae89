"""Tools around the runtime (soak, TP check, profiling, tiny random-weight models): the CLI
and the tests import them; the runtime (core, policies, serve) never does."""
