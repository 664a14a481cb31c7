"""The HTTP server (`app.py`): routes, auth, the error map and metrics over the engine core.

Nothing is imported here, so that `serving.auth` stays light for the client commands."""
