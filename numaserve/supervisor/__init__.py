"""The supervisor side: listeners, slots, spawn, supervision loop, ops socket."""
