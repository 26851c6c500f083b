import unittest

from formcheck import Schema, is_int, matches, max_len, min_len, one_of, required

SIGNUP = Schema({
    "username": [required(), min_len(3), max_len(16)],
    "email": [required(), matches(r"[^@\s]+@[^@\s]+\.\w+", "is not an email address")],
    "age": [is_int(13, 120)],
    "plan": [required(), one_of("free", "pro")],
})

GOOD = {"username": "ada", "email": "ada@example.org", "age": "36", "plan": "pro"}


class SchemaTest(unittest.TestCase):
    def test_valid(self):
        self.assertEqual(SIGNUP.errors(GOOD), {})
        self.assertEqual(SIGNUP.clean(dict(GOOD, username=" ada ")), GOOD)

    def test_one_bad_field(self):
        self.assertEqual(SIGNUP.errors(dict(GOOD, username="al")),
                         {"username": "must be at least 3 characters"})

    def test_every_field_checked_with_its_own_rules(self):
        bad = {"username": "", "email": "nope", "age": "9", "plan": "gold"}
        self.assertEqual(SIGNUP.errors(bad), {
            "username": "is required",
            "email": "is not an email address",
            "age": "must be at least 13",
            "plan": "must be one of free, pro",
        })

    def test_first_failing_rule_wins(self):
        self.assertEqual(Schema({"x": [required(), min_len(5)]}).errors({}), {"x": "is required"})

    def test_clean_raises(self):
        with self.assertRaisesRegex(ValueError, "email is required"):
            SIGNUP.clean(dict(GOOD, email=""))


if __name__ == "__main__":
    unittest.main()
