"""kvstrata.protos: see DESIGN.md; filled in by later issues."""
