"""Instance agent: one per GPU group; round scheduler, engine, memory substrate."""
