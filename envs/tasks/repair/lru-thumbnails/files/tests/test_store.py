import unittest

from thumbcache import ThumbnailStore


class StoreTest(unittest.TestCase):
    def setUp(self):
        self.rendered = []

        def render(path, size):
            self.rendered.append((path, size))
            return path.encode() * (size // 64)

        self.store = ThumbnailStore(render, capacity=40)

    def test_cached(self):
        self.store.thumbnail("cat.png", 128)
        self.store.thumbnail("cat.png", 128)
        self.assertEqual(self.rendered, [("cat.png", 128)])

    def test_working_set_survives(self):
        # the page header logo is shown on every page, other images once
        for image in ["a.png", "b.png", "c.png", "d.png"]:
            self.store.thumbnail("logo.png", 64)
            self.store.thumbnail(image, 128)
        self.store.thumbnail("logo.png", 64)
        self.assertEqual(self.rendered.count(("logo.png", 64)), 1, "the logo was evicted although used constantly")

    def test_invalidate(self):
        self.store.thumbnail("cat.png", 64)
        self.store.invalidate("cat.png")
        self.store.thumbnail("cat.png", 64)
        self.assertEqual(len(self.rendered), 2)
        with self.assertRaises(ValueError):
            self.store.thumbnail("cat.png", 100)


if __name__ == "__main__":
    unittest.main()
