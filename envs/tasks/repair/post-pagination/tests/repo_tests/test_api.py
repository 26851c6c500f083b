import unittest

from blogapi import BadRequest, PageNotFound, list_posts


def make_posts(n):
    return [{"id": i, "title": f"Post {i}", "published": f"2024-01-{i:02d}"} for i in range(1, n + 1)]


class ListPostsTest(unittest.TestCase):
    def test_first_page_newest_first(self):
        out = list_posts(make_posts(12), {"per_page": "5"})
        self.assertEqual([p["id"] for p in out["items"]], [12, 11, 10, 9, 8])
        self.assertEqual(out["pages"], 3)
        self.assertIsNone(out["links"]["prev"])
        self.assertEqual(out["links"]["next"], "/posts?page=2&per_page=5")

    def test_last_page_has_no_next_link(self):
        out = list_posts(make_posts(10), {"page": "2", "per_page": "5"})
        self.assertEqual([p["id"] for p in out["items"]], [5, 4, 3, 2, 1])
        self.assertEqual(out["pages"], 2)
        self.assertIsNone(out["links"]["next"], "the next link on the last page leads to an empty page")

    def test_window_never_lists_empty_pages(self):
        out = list_posts(make_posts(20), {"page": "4", "per_page": "5"})
        self.assertEqual([w["page"] for w in out["links"]["window"]], [1, 2, 3, 4])

    def test_bad_parameters(self):
        with self.assertRaises(BadRequest):
            list_posts(make_posts(3), {"page": "two"})
        with self.assertRaises(BadRequest):
            list_posts(make_posts(3), {"per_page": "0"})

    def test_page_past_end(self):
        with self.assertRaises(PageNotFound):
            list_posts(make_posts(10), {"page": "3", "per_page": "5"})


if __name__ == "__main__":
    unittest.main()
