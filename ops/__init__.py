"""Operator files, installed as `talaria.ops`: audit queries (`audit/*.sql`) and the OTel collector config."""
