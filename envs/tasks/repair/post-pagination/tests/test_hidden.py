import unittest

from blogapi import PageNotFound, list_posts, page_count, paginate


class HiddenPaginationTest(unittest.TestCase):
    def test_page_count_matches_ceiling(self):
        for per_page in range(1, 13):
            for total in range(0, 60):
                expected = max(1, -(-total // per_page))
                self.assertEqual(page_count(total, per_page), expected, (total, per_page))

    def test_every_page_non_empty(self):
        for total in (1, 7, 14, 21, 50):
            items = list(range(total))
            pages = page_count(total, 7)
            seen = []
            for n in range(1, pages + 1):
                page = paginate(items, n, 7)
                self.assertTrue(page.items, (total, n))
                seen.extend(page.items)
                self.assertEqual(page.has_next, n < pages)
            self.assertEqual(seen, items)
            with self.assertRaises(PageNotFound):
                paginate(items, pages + 1, 7)

    def test_single_full_page(self):
        page = paginate(["a", "b", "c"], 1, 3)
        self.assertEqual(page.pages, 1)
        self.assertFalse(page.has_next)

    def test_empty_listing(self):
        page = paginate([], 1, 10)
        self.assertEqual((page.pages, page.items, page.first_index, page.last_index), (1, [], 0, 0))

    def test_api_exact_multiple_of_max(self):
        posts = [{"id": i, "title": str(i), "published": f"2023-05-{i % 28 + 1:02d}"} for i in range(100)]
        out = list_posts(posts, {"page": "2", "per_page": "50"})
        self.assertEqual(out["pages"], 2)
        self.assertIsNone(out["links"]["next"])
        self.assertEqual(out["showing"], [51, 100])
        with self.assertRaises(PageNotFound):
            list_posts(posts, {"page": "3", "per_page": "80"})


if __name__ == "__main__":
    unittest.main()
