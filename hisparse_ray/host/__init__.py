"""The pinned host pool of a decode replica (adapter ring): the shared ``/dev/shm`` segment, its
cross-process ordering, and the page copies between device views and the pool."""
