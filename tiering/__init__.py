"""kvstrata.tiering: see DESIGN.md; filled in by later issues."""
