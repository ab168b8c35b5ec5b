"""The application on top of the library: what ``r3lightning-train`` and ``r3lightning-serve`` run."""
