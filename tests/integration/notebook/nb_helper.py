"""A notebook's local helper module: the workers cannot import it, so it goes by value."""


def shout(word: str) -> str:
    return word.upper() + "!"
