// Every table of one schema in a Hive metastore on embedded Derby, with the folder its data is in:
// one JSON line {"table": "location", ...}. Compiled once by hive_table_reader.py, then run for each read
// (`java -cp <classes>:<pyspark's derby jars> HiveMetastoreTables METASTORE_DB SCHEMA`): a JVM of its
// own, since embedded Derby admits one JVM at a time, but no Spark. It reads the metastore's own
// tables as Spark's HiveExternalCatalog does: a data source table's folder is its storage's "path"
// serde property, else the storage descriptor's LOCATION.

import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.util.Map;
import java.util.TreeMap;

public class HiveMetastoreTables {
    private static final String QUERY =
        "SELECT t.TBL_NAME, s.LOCATION, p.PARAM_VALUE FROM APP.TBLS t"
        + " JOIN APP.DBS d ON t.DB_ID = d.DB_ID"
        + " LEFT JOIN APP.SDS s ON t.SD_ID = s.SD_ID"
        + " LEFT JOIN APP.SERDE_PARAMS p ON p.SERDE_ID = s.SERDE_ID AND p.PARAM_KEY = 'path'"
        + " WHERE d.NAME = ?";

    public static void main(String[] args) throws Exception {
        Map<String, String> found = new TreeMap<>();
        String url = "jdbc:derby:" + args[0];
        try (Connection db = DriverManager.getConnection(url)) {
            db.setReadOnly(true);
            try (PreparedStatement query = db.prepareStatement(QUERY)) {
                query.setString(1, args[1].toLowerCase());
                try (ResultSet row = query.executeQuery()) {
                    while (row.next()) {
                        String path = row.getString(3);
                        found.put(row.getString(1), path != null ? path : row.getString(2));
                    }
                }
            }
        }
        try {
            DriverManager.getConnection(url + ";shutdown=true");  // closes the database cleanly, then throws
        } catch (SQLException shutdown) {
            if (!"08006".equals(shutdown.getSQLState())) {
                throw shutdown;
            }
        }
        StringBuilder out = new StringBuilder("{");
        for (Map.Entry<String, String> table : found.entrySet()) {
            if (out.length() > 1) {
                out.append(", ");
            }
            out.append(quoted(table.getKey())).append(": ").append(quoted(table.getValue()));
        }
        System.out.println(out.append("}"));
    }

    private static String quoted(String text) {
        if (text == null) {
            return "null";
        }
        StringBuilder out = new StringBuilder("\"");
        for (char c : text.toCharArray()) {
            if (c == '"' || c == '\\') {
                out.append('\\').append(c);
            } else if (c < 0x20) {
                out.append(String.format("\\u%04x", (int) c));
            } else {
                out.append(c);
            }
        }
        return out.append('"').toString();
    }
}
