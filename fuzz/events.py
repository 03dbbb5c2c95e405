"""Event counts of this fuzzing process: what the machine's rules did (the campaign runner reads and resets them)."""

from collections import Counter

EVENTS: Counter = Counter()
