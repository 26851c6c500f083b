import unittest

from blogapi import PageNotFound, page_count, paginate


class PageCountTest(unittest.TestCase):
    def test_partial_last_page(self):
        self.assertEqual(page_count(25, 10), 3)

    def test_exact_multiple(self):
        self.assertEqual(page_count(20, 10), 2, "20 items at 10 per page fill exactly 2 pages")

    def test_empty_listing_has_one_page(self):
        self.assertEqual(page_count(0, 10), 1)

    def test_bad_per_page(self):
        with self.assertRaises(ValueError):
            page_count(5, 0)


class PaginateTest(unittest.TestCase):
    def test_middle_page(self):
        page = paginate(list(range(1, 26)), 2, 10)
        self.assertEqual(page.items, list(range(11, 21)))
        self.assertTrue(page.has_prev)
        self.assertTrue(page.has_next)
        self.assertEqual((page.first_index, page.last_index), (11, 20))

    def test_last_page_of_exact_multiple(self):
        page = paginate(list(range(30)), 3, 10)
        self.assertEqual(page.items, list(range(20, 30)))
        self.assertFalse(page.has_next, "the last full page must not offer a next page")

    def test_past_the_end(self):
        with self.assertRaises(PageNotFound):
            paginate(list(range(25)), 4, 10)


if __name__ == "__main__":
    unittest.main()
