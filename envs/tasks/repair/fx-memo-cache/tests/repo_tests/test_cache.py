import unittest

from fxconv import memoize


class MemoizeTest(unittest.TestCase):
    def test_positional(self):
        calls = []

        @memoize
        def square(x):
            calls.append(x)
            return x * x

        self.assertEqual([square(3), square(3), square(4)], [9, 9, 16])
        self.assertEqual(calls, [3, 4])
        self.assertEqual(square.cache_info(), {"hits": 1, "misses": 2, "size": 2})
        square.cache_clear()
        self.assertEqual(square.cache_info(), {"hits": 0, "misses": 0, "size": 0})

    def test_keyword_values_matter(self):
        @memoize
        def greet(name, *, greeting="Hello"):
            return f"{greeting}, {name}!"

        self.assertEqual(greet("Ada", greeting="Hi"), "Hi, Ada!")
        self.assertEqual(greet("Ada", greeting="Bonjour"), "Bonjour, Ada!")

    def test_keywords_are_cached_too(self):
        calls = []

        @memoize
        def power(base, *, exp=2):
            calls.append((base, exp))
            return base ** exp

        self.assertEqual([power(2, exp=3), power(2, exp=3), power(2, exp=5)], [8, 8, 32])
        self.assertEqual(calls, [(2, 3), (2, 5)])


if __name__ == "__main__":
    unittest.main()
