def __getattr__(name: str) -> object:  # the names of the flat module this package replaced, until 0.3
    from r3lightning._aliases import moved_attribute

    return moved_attribute(__name__, name)
