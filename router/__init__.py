"""kvstrata.router: see DESIGN.md; filled in by later issues."""
