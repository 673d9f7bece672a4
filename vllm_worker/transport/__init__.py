"""How results travel from a worker to the frontend: a shared-memory result pool on one machine (`shm`,
`result_pool`) filled by batch assembly (`assembly`); bytes in the RPC reply otherwise."""
