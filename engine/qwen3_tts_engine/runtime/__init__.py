"""The engine core: handlers (one worker process per loaded variant), synthesis, routing.

Import submodules directly; this package stays empty so that a spawned worker imports only
what it runs (`runtime.worker` and the model code it needs)."""
