"""Stop strings found incrementally: one KMP automaton state per stop string, so each new
character costs O(number of stop strings), whatever their length or the text's."""


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.fallbacks = [_failure_table(stop) for stop in self.stops]
        self.matched = [0] * len(self.stops)  # per stop: its longest prefix the text ends with

    def feed(self, text: str, start: int) -> tuple[int, str] | None:
        """Advance over ``text``, which begins at index ``start`` of the whole text. Returns
        the (index, stop) of the earliest-starting stop string completed in it, if any."""
        hits = []
        for k, stop in enumerate(self.stops):
            end = self._advance(k, stop, text)
            if end is not None:
                hits.append((start + end - len(stop), stop))
        return min(hits) if hits else None

    def held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        return max(self.matched, default=0)

    def _advance(self, k: int, stop: str, text: str) -> int | None:
        """Feed ``text`` to stop ``k``; the index in ``text`` just past its first completion."""
        state, fallback = self.matched[k], self.fallbacks[k]
        for index, char in enumerate(text):
            while state and stop[state] != char:
                state = fallback[state - 1]
            if stop[state] == char:
                state += 1
            if state == len(stop):
                self.matched[k] = 0
                return index + 1
        self.matched[k] = state
        return None


def _failure_table(pattern: str) -> list[int]:
    """KMP: for each prefix length i+1, the length of its longest proper border."""
    table = [0] * len(pattern)
    border = 0
    for i in range(1, len(pattern)):
        while border and pattern[i] != pattern[border]:
            border = table[border - 1]
        if pattern[i] == pattern[border]:
            border += 1
        table[i] = border
    return table
