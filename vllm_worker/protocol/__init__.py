"""What crosses process boundaries: the request keys and the payload of a validated request (`spec`:
encoded in the frontend, decoded in the workers), the pickle-free tensor encoding (`wire`: engine IPC and
HTTP JSON), structured failures (`errors`) and the field checks shared with `api` (`checks`); and what both sides use alike (`host_threads`, `recent`)."""
