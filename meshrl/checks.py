"""One-line checks of a config section's fields, shared by every section's `check()`: each section
(beside its owner: meshrl/actors/generator_config.py, meshrl/losses.py, meshrl/weight_sync/__init__.py, ...)
names its own minimums and choices with these, so a bad value gets the same kind of line wherever it is."""

AUTO_ON_OFF = ("auto", "on", "off")  # a switch whose default is chosen per device or placement


def at_least(section, name: str, **minimums) -> None:
    """ValueError naming the first of `section`'s fields below its minimum."""
    for field_name, minimum in minimums.items():
        if getattr(section, field_name) < minimum:
            raise ValueError(f"{name}.{field_name} must be at least {minimum}, not {getattr(section, field_name)}")


def one_of(section, name: str, **choices) -> None:
    """ValueError naming the first of `section`'s fields that is not one of its choices."""
    for field_name, known in choices.items():
        if getattr(section, field_name) not in known:
            raise ValueError(f"unknown {name}.{field_name} {getattr(section, field_name)!r}; known: {', '.join(known)}")
