"""The engine core: handlers (one worker process per loaded variant), synthesis, routing.

Import submodules directly; this package stays empty so that a spawned worker imports only
what it runs (`worker.main` and the model code it needs)."""
