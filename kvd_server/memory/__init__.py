"""Host memory: the pool file, tenants' pool files, the extents namespaces grow by and the shared index engines map."""
