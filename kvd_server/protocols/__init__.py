"""The two engine protocols' operations over the core: the call path (gRPC lookups, loads and stores), the fast path (engines that map the index) and the completions both end in."""
