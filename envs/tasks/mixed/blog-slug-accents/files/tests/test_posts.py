import unittest
from datetime import date

from blogkit.posts import PostError, parse_post

POST = """---
title: Hello, world
date: 2024-05-01
tags: news, meta
---
Body text.
"""


class PostTest(unittest.TestCase):
    def test_front_matter(self):
        p = parse_post(POST)
        self.assertEqual((p.title, p.day, p.tags, p.body), ("Hello, world", date(2024, 5, 1), ("news", "meta"), "Body text."))

    def test_url(self):
        self.assertEqual(parse_post(POST).url, "/2024/hello-world/")

    def test_missing_date(self):
        with self.assertRaises(PostError):
            parse_post("---\ntitle: x\n---\nbody\n")


if __name__ == "__main__":
    unittest.main()
