import random
import unittest

from thumbcache import ByteLRU


class ModelLRU:
    """A slow, obviously correct model: a list of (key, value), least recent first."""

    def __init__(self, capacity):
        self.capacity, self.entries, self.evictions = capacity, [], 0

    def used(self):
        return sum(len(v) for _, v in self.entries)

    def get(self, key):
        for i, (k, v) in enumerate(self.entries):
            if k == key:
                self.entries.append(self.entries.pop(i))
                return v
        return None

    def put(self, key, value):
        self.entries = [(k, v) for k, v in self.entries if k != key]
        while self.used() + len(value) > self.capacity:
            self.entries.pop(0)
            self.evictions += 1
        self.entries.append((key, value))


class HiddenLRUTest(unittest.TestCase):
    def test_against_model(self):
        rng = random.Random(99)
        for capacity in (5, 16, 50):
            real, model = ByteLRU(capacity), ModelLRU(capacity)
            for step in range(400):
                key = rng.randrange(12)
                if rng.random() < 0.5:
                    self.assertEqual(real.get(key), model.get(key), (capacity, step))
                else:
                    value = bytes([key]) * rng.randint(0, min(capacity, 9))
                    real.put(key, value)
                    model.put(key, value)
                self.assertEqual(list(real), [k for k, _ in model.entries], (capacity, step))
                self.assertEqual(real.used, model.used())
            self.assertEqual(real.evictions, model.evictions)

    def test_peek_and_contains_do_not_refresh(self):
        c = ByteLRU(4)
        c.put("a", b"aa")
        c.put("b", b"bb")
        self.assertEqual(c.peek("a"), b"aa")
        self.assertIn("a", c)
        c.put("c", b"cc")
        self.assertEqual(list(c), ["b", "c"])

    def test_reput_refreshes(self):
        c = ByteLRU(6)
        c.put("a", b"aa")
        c.put("b", b"bb")
        c.put("c", b"cc")
        c.put("a", b"AA")
        c.put("d", b"dd")
        self.assertEqual(list(c), ["c", "a", "d"])
        self.assertEqual(c.get("a"), b"AA")


if __name__ == "__main__":
    unittest.main()
