"""Router: session table, leases, placement policies; a pure core in an asyncio shell."""
