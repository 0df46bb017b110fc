"""The contract every Talaria service imports: subjects, messages, settings, schema."""
