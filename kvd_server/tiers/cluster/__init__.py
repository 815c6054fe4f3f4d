"""The cluster tier: a Mooncake store shared by nodes, its directory of published blocks and the store agent process that holds the store's client."""
