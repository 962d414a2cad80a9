"""kvguard."""
