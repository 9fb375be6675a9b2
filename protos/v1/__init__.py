"""Generated from protos/kvstrata/v1 by kvstrata.protos.generate."""
