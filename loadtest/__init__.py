"""kvpush load generator, engine simulator and benchmark driver."""
