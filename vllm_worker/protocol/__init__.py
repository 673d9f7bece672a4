"""What crosses process boundaries: the request keys and their payload (`spec`: validated in the frontend,
decoded in the workers) and the pickle-free tensor encoding (`wire`: engine IPC and HTTP JSON)."""
