import tempfile
import unittest
from pathlib import Path

from svcconf import ConfigError, load
from svcconf.defaults import DEFAULTS


class LoaderTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def ini(self, text):
        p = Path(self.dir.name) / "svc.ini"
        p.write_text(text)
        return p

    def test_defaults(self):
        self.assertEqual(dict(load(environ={}).values), DEFAULTS)

    def test_file_overrides_defaults(self):
        s = load(self.ini("[service]\nport = 9000\ndebug = yes\n"), environ={})
        self.assertEqual((s.port, s.debug, s.workers), (9000, True, 4))

    def test_environment_overrides_the_file(self):
        s = load(self.ini("[service]\nport = 9000\n"), environ={"SVC_PORT": "9100"})
        self.assertEqual(s.port, 9100)

    def test_unknown_setting_in_file(self):
        with self.assertRaisesRegex(ConfigError, "colour"):
            load(self.ini("[service]\ncolour = blue\n"), environ={})


if __name__ == "__main__":
    unittest.main()
