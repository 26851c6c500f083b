import unittest

from blogkit.text import excerpt, reading_minutes, slugify


class SlugTest(unittest.TestCase):
    def test_ascii_titles(self):
        self.assertEqual(slugify("Welcome to the team blog"), "welcome-to-the-team-blog")
        self.assertEqual(slugify("Post-mortem: the 14 March outage"), "post-mortem-the-14-march-outage")

    def test_length_limit_does_not_end_in_a_dash(self):
        self.assertEqual(slugify("aaaa bbbb", max_len=5), "aaaa")

    def test_accented_letters_keep_their_base_letter(self):
        self.assertEqual(slugify("Crème brûlée for the release party"), "creme-brulee-for-the-release-party")
        self.assertEqual(slugify("Notes from the Zürich offsite"), "notes-from-the-zurich-offsite")


class ExcerptTest(unittest.TestCase):
    def test_short_paragraph_is_whole(self):
        self.assertEqual(excerpt("One two three.\n\nSecond."), "One two three.")

    def test_long_paragraph_is_cut(self):
        self.assertEqual(excerpt("a b c d e", words=3), "a b c …")

    def test_reading_time(self):
        self.assertEqual(reading_minutes("word " * 10), 1)
        self.assertEqual(reading_minutes("word " * 441), 3)


if __name__ == "__main__":
    unittest.main()
