"""The validation choke point: everything a request must satisfy before it has any
effect (graph schema and extents, row ids). Pure functions, no I/O."""
