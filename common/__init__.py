"""Runtime shared by two or more omnistage services."""
