import unittest

from vertools.semver import VersionError, compare, parse


class ParseTest(unittest.TestCase):
    def test_parts(self):
        v = parse("v1.2.3-rc.1+build.7")
        self.assertEqual((v.major, v.minor, v.patch, v.pre, v.build), (1, 2, 3, ("rc", "1"), ("build", "7")))
        self.assertEqual(str(v), "1.2.3-rc.1+build.7")

    def test_bad_versions(self):
        for text in ("1.2", "01.2.3", "1.2.3-", "1.2.3-a..b"):
            with self.assertRaises(VersionError, msg=text):
                parse(text)


class PrecedenceTest(unittest.TestCase):
    def test_numeric_parts(self):
        self.assertEqual(compare("1.10.0", "1.9.0"), 1)
        self.assertEqual(compare("2.0.0", "2.0.0+build.1"), 0)

    def test_prerelease_is_lower_than_the_release(self):
        self.assertEqual(compare("1.0.0-rc.1", "1.0.0"), -1)

    def test_the_documented_example(self):
        order = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta", "1.0.0-beta.2",
                 "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0"]
        self.assertEqual([str(v) for v in sorted(parse(v) for v in reversed(order))], order)


if __name__ == "__main__":
    unittest.main()
