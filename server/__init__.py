"""The HTTP server: `server.app.create_app(server.settings.Settings())`.

Nothing is imported here, so that clients can import `server.protocol` without torch or FastAPI.
"""

__all__: list[str] = []
