import unittest

from thumbcache import ByteLRU


class ByteLRUTest(unittest.TestCase):
    def test_basic(self):
        c = ByteLRU(10)
        c.put("a", b"1234")
        self.assertEqual(c.get("a"), b"1234")
        self.assertIsNone(c.get("b"))
        self.assertEqual(c.stats(), {"entries": 1, "bytes": 4, "hits": 1, "misses": 1, "evictions": 0})

    def test_evicts_least_recently_added(self):
        c = ByteLRU(8)
        c.put("a", b"aaaa")
        c.put("b", b"bbbb")
        c.put("c", b"cccc")
        self.assertEqual(list(c), ["b", "c"], "the oldest entry (a) should have been evicted")

    def test_get_refreshes(self):
        c = ByteLRU(8)
        c.put("a", b"aaaa")
        c.put("b", b"bbbb")
        c.get("a")
        c.put("c", b"cccc")
        self.assertIn("a", c, "a was used recently and must survive")
        self.assertNotIn("b", c)

    def test_evicts_as_many_as_needed(self):
        c = ByteLRU(10)
        for k in "abcde":
            c.put(k, b"xx")
        c.put("big", b"y" * 7)
        self.assertEqual(list(c), ["e", "big"])
        self.assertEqual((c.used, c.evictions), (9, 4))

    def test_replace_same_key(self):
        c = ByteLRU(6)
        c.put("a", b"123")
        c.put("a", b"123456")
        self.assertEqual((len(c), c.used), (1, 6))

    def test_too_big(self):
        with self.assertRaises(ValueError):
            ByteLRU(4).put("a", b"12345")


if __name__ == "__main__":
    unittest.main()
