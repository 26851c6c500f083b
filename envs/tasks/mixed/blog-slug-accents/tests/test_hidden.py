import unittest
from datetime import date

from blogkit.posts import Post
from blogkit.text import slugify


class HiddenSlugTest(unittest.TestCase):
    def test_more_accents(self):
        self.assertEqual(slugify("Ångström, Über & naïve façades"), "angstrom-uber-naive-facades")
        self.assertEqual(slugify("Señor Müller's crêpes — à la carte"), "senor-muller-s-crepes-a-la-carte")

    def test_letters_without_an_ascii_base_still_separate(self):
        self.assertEqual(slugify("日本語 release notes"), "release-notes")
        self.assertEqual(slugify("ünïcödé"), "unicode")

    def test_length_counts_the_slug(self):
        self.assertEqual(slugify("é" * 80, max_len=10), "e" * 10)
        self.assertEqual(slugify("Crème brûlée", max_len=6), "creme")

    def test_post_url(self):
        p = Post("Crème brûlée for the release party", date(2024, 2, 16), "")
        self.assertEqual(p.url, "/2024/creme-brulee-for-the-release-party/")

    def test_ascii_unchanged(self):
        self.assertEqual(slugify("  --Hello__World 2024--  "), "hello-world-2024")


if __name__ == "__main__":
    unittest.main()
